"""pd-lifecycle as a vLLM KV connector (``kv_connector_module_path``).

The parts that need no vLLM live here and are tested without it: what a
user writes in ``kv_connector_extra_config`` (:mod:`vllm_connector.config`)
and what rides in a request's ``kv_transfer_params``
(:mod:`vllm_connector.params`). The library's core never imports this
package.
"""

from vllm_connector.config import SETTINGS, ExtraConfig, ExtraConfigError, ExtraConfigTypeError
from vllm_connector.params import ParamsError, TransferParams, room_of

__all__ = [
    "SETTINGS",
    "ExtraConfig",
    "ExtraConfigError",
    "ExtraConfigTypeError",
    "ParamsError",
    "TransferParams",
    "room_of",
]
