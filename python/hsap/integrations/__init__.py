"""Drop-ins for trainers: HuggingFace transformers (`hsap.integrations.transformers`) and
Megatron's PackedSeqParams (`hsap.integrations.megatron`). Each imports its framework only
when used."""
