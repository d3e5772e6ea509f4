"""``model.lora``'s settings as a type that needs no torch: the config builds and checks them before anything heavy
loads; ``models.lora`` applies them to a model through peft."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class LoraSettings:
    """Low-rank adapters (LoRA, Hu et al. 2021) on the transformer's linear layers: each targeted weight W trains as
    W + (alpha / r) * B @ A with A [r, in] and B [out, r]; W itself stays frozen."""

    r: int = 8  # the adapters' rank
    alpha: float = 16.0  # the update's scale is alpha / r
    dropout: float = 0.0  # dropout on an adapter's input (training only)
    # Names (or dotted name endings) of the linear modules that get adapters, e.g. [query, key, value] for BERT or
    # [q_proj, k_proj, v_proj, o_proj] for Qwen/Llama; None: peft's default for the model's family (the query and
    # value projections)
    target_modules: list[str] | None = None

    def problem(self, key: str) -> str | None:
        """A one-line error naming ``key.<setting>`` for settings no model can train with; None when they are valid
        (whether the target modules exist is checked on the model: ``models.lora.apply_lora``)."""
        if self.r < 1:
            return f"{key}.r must be >= 1, got {self.r}"
        if not self.alpha > 0:
            return f"{key}.alpha must be > 0, got {self.alpha}"
        if not 0 <= self.dropout < 1:
            return f"{key}.dropout must be in [0, 1), got {self.dropout}"
        targets = self.target_modules
        if targets is not None and not (targets and all(name.strip() for name in targets)):
            return f"{key}.target_modules: name modules (or leave it out for the family's default), got {targets}"
        return None
