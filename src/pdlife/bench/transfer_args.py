"""``pdlife bench-transfer``'s flags: every check before a process is spawned
(the sizes fit together and this machine, the TP sizes split the heads, the
JSON file can be written, the backend loads here), each refusal one line
naming the flag."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from pdlife.bench.transfer_shape import DTYPE_BYTES, Shape, shape_of

__all__ = ["MAX_REPS", "MAX_STEP_US", "check_args", "heads_flags"]

#: the most repetitions: the launcher waits 600 s for each side's timings
MAX_REPS = 1000
#: the longest pause between steps
MAX_STEP_US = 1_000_000


def heads_flags(args: argparse.Namespace) -> dict[str, Any]:
    """The flags of the head-sliced case, as :func:`shape_of` takes them."""
    return {
        "prefill_tp": args.prefill_tp,
        "decode_tp": args.decode_tp,
        "page_tokens": args.page_tokens,
        "head_dim": args.head_dim,
        "kv_heads": args.kv_heads,
        "layout": args.layout,
        "staging": args.staging,
    }


def _check_shape(args: argparse.Namespace) -> Shape:
    """The geometry the flags give, or the one-line reason they do not fit together."""
    from pdlife.args import UsageError

    heads = heads_flags(args)
    s = shape_of(args.mib, args.page_kib, args.buffers, args.shuffle, **heads)
    if s.page_tokens > 1 or s.kv_heads > 1:  # the head geometry: pages of heads
        if args.page_kib is not None:
            raise UsageError(
                f"--page-kib {args.page_kib}",
                "pages are --page-tokens x --kv-heads x --head-dim here (head-sliced "
                "case): leave --page-kib out",
            )
        for flag, tp in (("--prefill-tp", s.prefill_tp), ("--decode-tp", s.decode_tp)):
            if s.kv_heads % tp if tp <= s.kv_heads else tp % s.kv_heads:
                raise UsageError(
                    f"{flag} {tp}",
                    f"the {s.kv_heads} KV heads (--kv-heads) do not split over TP {tp}: give "
                    "a TP size that divides the head count, or a multiple of it",
                )
        each = args.mib * 1024 * 1024 // args.buffers
        if each % s.page_bytes(s.kv_heads):
            raise UsageError(
                f"--mib {args.mib}",
                f"each of the {args.buffers} buffer(s) of {each} bytes must be a whole number "
                f"of {s.page_bytes(s.kv_heads)}-byte pages (--page-tokens {s.page_tokens} x "
                f"--kv-heads {s.kv_heads} x --head-dim {s.head_bytes // DTYPE_BYTES} x "
                f"{DTYPE_BYTES} bytes)",
            )
        if args.staging and (s.layout != "token" or s.prefill_tp == s.decode_tp):
            raise UsageError(
                "--staging",
                "decode stages token-major head slices: give --layout token and TP sizes "
                "that differ",
            )
    elif args.staging:
        raise UsageError("--staging", "whole pages are never staged: give TP sizes that differ")
    elif args.layout != "token":
        raise UsageError(
            f"--layout {args.layout}",
            "a page of one token of one head has one layout: give --kv-heads, --page-tokens "
            "or TP sizes that differ",
        )
    return s


def check_args(args: argparse.Namespace) -> Shape:
    """Every check of ``bench-transfer``'s flags, before a process is spawned:
    the sizes fit together and this machine, the JSON file can be written, the
    backend loads here; the geometry they give."""
    import os

    from pdlife.args import UsageError
    from transport.errors import TransportError
    from transport.registry import get_backend

    each = args.mib * 1024 // args.buffers  # KiB per KV buffer
    if args.buffers > args.mib * 1024 or (args.mib * 1024) % args.buffers:
        raise UsageError(
            f"--buffers {args.buffers}",
            f"the {args.mib} MiB must split into equal buffers: give a count that divides "
            f"{args.mib * 1024} KiB",
        )
    page_kib = args.page_kib or 256
    if args.page_kib is not None and (page_kib > each or each % page_kib):
        raise UsageError(
            f"--page-kib {args.page_kib}",
            f"each of the {args.buffers} buffer(s) of {each} KiB must be a whole number of "
            f"pages: give a page size that divides {each} KiB",
        )
    shape = _check_shape(args)
    if shape.pages < 1 or (args.page_kib is None and shape.kv_heads == 1 and each % page_kib):
        raise UsageError(
            f"--mib {args.mib}",
            f"each of the {args.buffers} buffer(s) of {each} KiB must hold whole pages of "
            f"{shape.page_bytes(shape.kv_heads)} bytes",
        )
    phys = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") >> 20
    held = shape.held_bytes() >> 20
    if held > phys // 2:
        raise UsageError(
            f"--mib {args.mib}",
            f"the ranks hold {held} MiB between them (their KV and decode's check pattern); "
            f"at most {phys // 2} MiB on this machine ({phys} MiB of memory)",
        )
    if args.step_us > MAX_STEP_US:
        raise UsageError(
            f"--step-us {args.step_us}",
            f"at most {MAX_STEP_US} (1 s): a scheduler steps at least once per second",
        )
    if args.reps > MAX_REPS:
        raise UsageError(
            f"--reps {args.reps}",
            f"at most {MAX_REPS}: the launcher waits 600 s for each side's timings",
        )
    for flag, path in (("--json", args.json), ("--timeline", getattr(args, "timeline", None))):
        out = None if path is None else Path(path)
        if out is not None and (
            out.is_dir() or not out.parent.is_dir() or not os.access(out.parent, os.W_OK)
        ):
            raise UsageError(
                f"{flag} {path}",
                "cannot write a file there; give a file path in an existing, writable directory",
            )
    try:
        get_backend(args.backend)
    except TransportError as e:  # it names the missing package and how to install it
        raise UsageError(f"--backend {args.backend}", str(e)) from None
    return shape
