"""Model configuration: one dataclass, every field documented. Each field declares what it accepts
in its annotation (schema/fields.py), and the same check reads them all."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Literal

from schema.fields import NonNegative, Positive, Probability, Range, check_fields

Norm = Literal["deepnorm", "deepnorm-xavier-1.15", "postln", "preln", "postln-init", "subln", "branchnorm"]
"""The strategies of model/norms.py (a test keeps the two lists equal)."""


TRAINING_ONLY = ("dropout", "attention_dropout", "activation_dropout", "label_smoothing")
"""ModelConfig's keys that shape training only, not the weights or the function they compute: a
resumed run may change them, and checkpoints that differ in them are of one model."""


@dataclass(kw_only=True)
class ModelConfig:
    """An encoder-decoder Transformer for translation (fairseq-style, shared vocabulary)."""

    encoder_layers: Positive = 6
    """N, the number of encoder layers."""
    decoder_layers: Positive = 6
    """M, the number of decoder layers."""
    d_model: Annotated[int, Range(ge=4)] = 512
    """Width of the residual stream (and of the shared embedding); the sinusoidal position
    table needs at least 4."""
    heads: Positive = 8
    """Attention heads; must divide d_model."""
    ffn_dim: Positive = 2048
    """Inner width of the feed-forward network."""
    vocab_size: NonNegative = 0
    """Joint vocabulary size; 0 means 'take it from the SentencePiece model of the data'."""
    norm: Norm = "deepnorm"
    """Normalisation strategy: deepnorm | deepnorm-xavier-1.15 | postln | preln | postln-init |
    subln | branchnorm (formulas in model/norms.py)."""
    branchnorm_max_norm_step: Positive = 4000
    """BranchNorm's T: the branch is normalised with weight 1 − t/T and is plain Post-LN from
    optimizer step T on (norm: branchnorm only)."""
    dropout: Probability = 0.1
    """Dropout on embeddings and on the output of every residual branch."""
    attention_dropout: Probability = 0.0
    """Dropout on attention probabilities."""
    activation_dropout: Probability = 0.0
    """Dropout after the FFN activation."""
    activation: Literal["relu", "gelu"] = "relu"
    """FFN activation: relu | gelu."""
    max_positions: Positive = 1024
    """Longest sequence the sinusoidal position table covers."""
    pad_id: Literal[0] = 0
    """Padding token id (the data pipeline fixes pad=0, unk=1, bos=2, eos=3)."""
    label_smoothing: Probability = 0.1
    """ε of the label-smoothed cross-entropy (torch's definition: ε spread uniformly over V)."""
    layernorm_eps: Annotated[float, Range(gt=0.0, lt=1.0)] = 1e-5
    """ε inside every LayerNorm."""

    def validate(self) -> None:
        """Raise ValueError naming the offending key when a value or the shape is impossible."""
        check_fields(self, "model")
        from model.norms import resolve  # the strategy's own checks (a renamed strategy says so)

        resolve(self.norm, self.encoder_layers, self.decoder_layers, self.branchnorm_max_norm_step)
        if self.d_model % self.heads:
            raise ValueError(f"model.heads={self.heads} must divide model.d_model={self.d_model}")
        if self.vocab_size <= 0:
            raise ValueError("model.vocab_size must be set (> 0) before building the model")
