"""Model configuration: one dataclass, every field documented."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(kw_only=True)
class ModelConfig:
    """An encoder-decoder Transformer for translation (fairseq-style, shared vocabulary)."""

    encoder_layers: int = 6
    """N, the number of encoder layers."""
    decoder_layers: int = 6
    """M, the number of decoder layers."""
    d_model: int = 512
    """Width of the residual stream (and of the shared embedding)."""
    heads: int = 8
    """Attention heads; must divide d_model."""
    ffn_dim: int = 2048
    """Inner width of the feed-forward network."""
    vocab_size: int = 0
    """Joint vocabulary size; 0 means 'take it from the SentencePiece model of the data'."""
    norm: str = "deepnorm"
    """Normalisation strategy: deepnorm | deepnorm-xavier-1.15 | postln | preln | postln-init |
    subln | branchnorm (formulas in model/norms.py)."""
    branchnorm_max_norm_step: int = 4000
    """BranchNorm's T: the branch is normalised with weight 1 − t/T and is plain Post-LN from
    optimizer step T on (norm: branchnorm only)."""
    dropout: float = 0.1
    """Dropout on embeddings and on the output of every residual branch."""
    attention_dropout: float = 0.0
    """Dropout on attention probabilities."""
    activation_dropout: float = 0.0
    """Dropout after the FFN activation."""
    activation: str = "relu"
    """FFN activation: relu | gelu."""
    max_positions: int = 1024
    """Longest sequence the sinusoidal position table covers."""
    pad_id: int = 0
    """Padding token id (the data pipeline fixes pad=0, unk=1, bos=2, eos=3)."""
    label_smoothing: float = 0.1
    """ε of the label-smoothed cross-entropy (torch's definition: ε spread uniformly over V)."""
    layernorm_eps: float = 1e-5
    """ε inside every LayerNorm."""

    def validate(self) -> None:
        """Raise ValueError naming the offending key when the shape is impossible."""
        if self.d_model % self.heads:
            raise ValueError(f"model.heads={self.heads} must divide model.d_model={self.d_model}")
        if self.encoder_layers < 1 or self.decoder_layers < 1:
            raise ValueError("model.encoder_layers and model.decoder_layers must be >= 1")
        if self.vocab_size <= 0:
            raise ValueError("model.vocab_size must be set (> 0) before building the model")
        if self.activation not in ("relu", "gelu"):
            raise ValueError(f"model.activation={self.activation!r}: use relu or gelu")
        if self.branchnorm_max_norm_step < 1:
            raise ValueError("model.branchnorm_max_norm_step must be >= 1")
        if not 0.0 <= self.label_smoothing < 1.0:
            raise ValueError("model.label_smoothing must be in [0, 1)")
