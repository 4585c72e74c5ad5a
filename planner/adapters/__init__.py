"""Adapters on a frozen base (LoRA) and quantized bases (QLoRA): a property of the training step, not a model
family. `targets` names a model's linear modules the way peft sees them, `lora` says which parameters train
and how the frozen ones are stored, `nf4` is bitsandbytes' 4-bit layout, `activations` what the frozen layers
and the adapters save for backward.
"""
