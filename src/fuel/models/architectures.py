"""The decoder architectures `LlamaModel` runs, one `ArchSpec` each: what changes the math, as data.

Every source reaches the model in llama.cpp's GGUF form (tensor names, metadata keys, the converter's Q/K row
permutation for llama files, Gemma norm weights stored with the +1 added), so one decoder-layer recipe
(`fuel.models.decoder_layer`) reads these fields instead of testing architecture names:

| arch   | permuted Q/K | QKV bias | q/k norm | post-norms | fused QKV, gate+up | act.      | ×√hidden | window |
|--------|--------------|----------|----------|------------|--------------------|-----------|----------|--------|
| llama  | yes          |          |          |            |                    | silu      |          | all    |
| qwen2  |              | yes      |          |            |                    | silu      |          | none   |
| qwen3  |              |          | yes      |            |                    | silu      |          | none   |
| phi3   |              |          |          |            | yes                | silu      |          | all    |
| gemma2 |              |          |          | yes        |                    | gelu_tanh | yes      | even   |
| gemma3 |              |          | yes      | yes        |                    | gelu_tanh | yes      | gemma3 |

`window_layers` says which layers attend over `<arch>.attention.sliding_window` keys when the file sets one
(0 or absent: none): "all" (Mistral is llama with a window), "even" (layers 0, 2, 4, ...: Gemma 2), "gemma3"
(all but every sixth), or "none" (the key is not read, as llama.cpp does not read it for these architectures).
`softcaps` reads `<arch>.attn_logit_softcapping` and `<arch>.final_logit_softcapping`
(llama.cpp's defaults 50 and 30 when absent). `rope_scaling` lists the values of `<arch>.rope.scaling.type`
the architecture supports ("linear" divides the positions by `rope.scaling.factor`; for Gemma 3 on its
global layers only); any other value is refused by name. `rope_factors` names the per-frequency factor
tensors the architecture reads: "freqs" (`rope_freqs.weight`, Llama 3), "longrope"
(`rope_factors_long/short.weight` and `rope.scaling.attn_factor`, Phi-3). A test may `dataclasses.replace`
an entry to flip one detail.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Activation = Literal["silu", "gelu_tanh"]
WindowLayers = Literal["none", "all", "even", "gemma3"]
RopeFactors = Literal["none", "freqs", "longrope"]

GEMMA3_GLOBAL_EVERY = 6  # Gemma 3: every sixth layer is global, the rest attend over the window


@dataclass(frozen=True)
class ArchSpec:
    """What one GGUF architecture's decoder layer does (module doc)."""

    name: str
    permuted_qk: bool = False
    qkv_bias: bool = False
    qk_norm: bool = False
    post_norms: bool = False
    fused_qkv: bool = False
    fused_gate_up: bool = False
    activation: Activation = "silu"
    embed_scale: bool = False
    window_layers: WindowLayers = "none"
    softcaps: bool = False
    rope_scaling: tuple[str, ...] = ("none",)
    rope_factors: RopeFactors = "none"
    # the rope base of the window layers when it differs from the file's (Gemma 3's reference hard-codes it;
    # a file may give `<arch>.rope.freq_base_swa`)
    local_rope_base: float | None = None

    def is_local(self, layer: int) -> bool:
        """Whether `layer` attends over the sliding window (when the file sets one)."""
        if self.window_layers == "all":
            return True
        if self.window_layers == "even":
            return layer % 2 == 0
        if self.window_layers == "gemma3":
            return (layer + 1) % GEMMA3_GLOBAL_EVERY != 0
        return False


ARCHITECTURES: dict[str, ArchSpec] = {spec.name: spec for spec in (
    ArchSpec("llama", permuted_qk=True, window_layers="all", rope_scaling=("none", "linear"), rope_factors="freqs"),
    ArchSpec("qwen2", qkv_bias=True),
    ArchSpec("qwen3", qk_norm=True),
    ArchSpec("phi3", fused_qkv=True, fused_gate_up=True, window_layers="all", rope_factors="longrope"),
    ArchSpec("gemma2", post_norms=True, activation="gelu_tanh", embed_scale=True, window_layers="even",
             softcaps=True),
    ArchSpec("gemma3", qk_norm=True, post_norms=True, activation="gelu_tanh", embed_scale=True,
             window_layers="gemma3", rope_scaling=("none", "linear"), local_rope_base=10_000.0),
)}
