"""Metadata rows, the slot allocator, page and state helpers, KV args."""

from buffers.allocator import SlotAllocator
from buffers.errors import (
    BadArgument,
    BadArgumentType,
    BuffersError,
    DoubleFree,
    GeometryMismatch,
    LayoutError,
    NotQuarantined,
    RowOverflow,
    SlotError,
    SlotNotOwned,
    SlotOutOfRange,
    SlotQuarantined,
)
from buffers.kv_args import (
    DescribesState,
    KVArgs,
    StateComponent,
    StateType,
    check_draft_geometry,
    collect_state,
)
from buffers.metadata import (
    MIN_ROW_BYTES,
    FieldSpec,
    MetadataBuffers,
    MetadataLayout,
    MetadataRecord,
)
from buffers.pages import C128, cp_filter_chunk, cp_filter_pages, cp_split, ring_state_page

__all__ = [
    "BadArgument",
    "BadArgumentType",
    "C128",
    "MIN_ROW_BYTES",
    "BuffersError",
    "DescribesState",
    "DoubleFree",
    "FieldSpec",
    "GeometryMismatch",
    "KVArgs",
    "LayoutError",
    "MetadataBuffers",
    "MetadataLayout",
    "MetadataRecord",
    "NotQuarantined",
    "RowOverflow",
    "SlotAllocator",
    "SlotError",
    "SlotNotOwned",
    "SlotOutOfRange",
    "SlotQuarantined",
    "StateComponent",
    "StateType",
    "check_draft_geometry",
    "collect_state",
    "cp_filter_chunk",
    "cp_filter_pages",
    "cp_split",
    "ring_state_page",
]
