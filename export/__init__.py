"""Export of trained models to the formats other tools load: Hugging Face transformers (Marian
class, safetensors, SentencePiece tokenizer) and CTranslate2. Only `./run.sh export`
(launcher/commands/export.py) imports this package; it imports `model/` and `parallel/`."""
