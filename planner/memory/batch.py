"""The input batch on the GPU, with the dtypes PyTorch and HF tokenizers really produce.

Token ids, attention masks, token-type ids and class labels are int64 (8 B) in PyTorch / HF tokenizers'
`return_tensors="pt"` output, not int32 (a common mistake). Tabular features are float32.
"""

from __future__ import annotations

from planner.spec import ModelSpec, TrainConfig

INT64 = 8
FLOAT32 = 4


def batch_bytes(model: ModelSpec, batch_size: int, seq_len: int) -> int:
    spec = model.inputs
    per_sample = 0
    text_tensors = int(spec.input_ids) + int(spec.attention_mask) + int(spec.token_type_ids)
    if model.transformers:
        per_sample += text_tensors * seq_len * INT64
    per_sample += spec.tabular_features * FLOAT32
    if spec.labels == "class":
        per_sample += INT64
    elif spec.labels == "tokens":
        per_sample += seq_len * INT64
    return batch_size * per_sample


def micro_batch_bytes(model: ModelSpec, config: TrainConfig) -> int:
    return batch_bytes(model, config.batch_size, config.seq_len)
