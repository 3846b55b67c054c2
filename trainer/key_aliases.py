"""The names people give this config's keys elsewhere, for the hint of an unknown key: a YAML key
or `--set train.learning_rate=…` is answered with `did you mean train.lr?` (schema/fields.py
`did_you_mean`; trainer/config.py passes this table)."""
from __future__ import annotations

_USUAL_NAMES = {
    # this config's key: the names people coming from fairseq, Megatron-LM, DeepSpeed, torchtitan or
    # transformers give it (hints only; nothing is read under these names)
    "train.lr": "learning_rate max_lr peak_lr",
    "train.warmup_steps": "warmup warmup_updates warmup_iters num_warmup_steps lr_warmup_steps",
    "train.max_steps": "steps max_update train_iters train_steps total_steps max_iters training_steps",
    "train.clip_norm": "clip_grad grad_clip clip_grad_norm gradient_clipping max_grad_norm max_norm",
    "train.micro_batches": "gradient_accumulation_steps grad_accum update_freq accumulate_grad_batches",
    "data.max_tokens": "batch_size micro_batch_size train_micro_batch_size_per_gpu local_batch_size",
    "train.seed data.seed": "random_seed",
    "model.encoder_layers model.decoder_layers": "layers num_layers n_layers",
    "model.encoder_layers": "num_encoder_layers enc_layers",
    "model.decoder_layers": "num_decoder_layers dec_layers",
    "model.d_model": "hidden_size dim embed_dim model_dim n_embd encoder_embed_dim",
    "model.ffn_dim": "ffn_hidden_size dim_feedforward intermediate_size ffn_embed_dim encoder_ffn_embed_dim d_ff",
    "model.heads": "num_heads n_heads num_attention_heads nhead attention_heads encoder_attention_heads",
    "model.norm": "normalization norm_type",
    "model.max_positions": "max_position_embeddings max_source_positions max_seq_len seq_len",
    "parallel.pipeline_stages": "stages pp num_stages pipeline_model_parallel_size pipeline_parallel_degree",
    "parallel.tensor_parallel": "tp tensor_model_parallel_size tensor_parallel_degree tensor_parallel_size",
    "parallel.data_parallel": "dp replicas data_parallel_size data_parallel_replicate_degree",
    "parallel.zero_stage": "zero zero_optimization",
    "parallel.precision": "dtype mixed_precision fp16 bf16 amp",
    "parallel.activation_checkpoint_interval": "activation_checkpointing checkpoint_activations recompute "
                                               "gradient_checkpointing",
    "run_dir": "save_dir output_dir out_dir dump_folder checkpoint_dir",
    "train.save_interval": "save_interval_updates checkpoint_interval save_steps",
    "train.keep_checkpoints": "keep_last_epochs keep_interval_updates keep_latest_k save_total_limit",
    "train.valid_interval": "validate_interval_updates eval_interval eval_steps",
    "train.init_from": "restore_file finetune_from_model",
    "data.corpus": "data_path dataset",
    "data.directions": "lang_pairs",
}
KEY_ALIASES: dict[str, tuple[str, ...]] = {word: tuple(keys.split()) for keys, words in _USUAL_NAMES.items()
                                           for word in words.split()}
"""A word people use for a key → the key(s) an unknown key of that name is pointed to
(`--set train.learning_rate=…`: did you mean train.lr?)."""
