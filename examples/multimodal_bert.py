"""The reference notes' multimodal classifier, written as a user would write it.

TabAE (BatchNorm1d -> Linear -> Linear) on tabular features, TextBertBase (a transformers BertModel with its
pooler + a Linear head) on text, and a merge Linear on both; loss = cross-entropy on the merge logits +
BCE-with-logits on the tabular logits. Estimate it with

    planner estimate --model examples/multimodal_bert.py:build --inputs examples/multimodal_bert.py:batch

Options: `-o tab_in=200` etc. become keyword arguments of `build`.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import BertConfig, BertModel


class TabAE(nn.Module):
    def __init__(self, tab_in: int, tab_out: int):
        super().__init__()
        self.norm = nn.BatchNorm1d(tab_in)
        self.encode = nn.Linear(tab_in, tab_out)
        self.head = nn.Linear(tab_out, 1)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        features = self.encode(self.norm(x))
        return features, self.head(features)


class TextBertBase(nn.Module):
    def __init__(self, text_out: int):
        super().__init__()
        self.bert = BertModel(BertConfig())  # bert-base-uncased sizes, random weights
        self.head = nn.Linear(self.bert.config.hidden_size, text_out)

    def forward(self, input_ids, attention_mask, token_type_ids):
        out = self.bert(input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids)
        return self.head(out.pooler_output)


class MultimodalBert(nn.Module):
    def __init__(self, tab_in: int = 100, tab_out: int = 128, text_out: int = 128, num_classes: int = 2):
        super().__init__()
        self.TabAE = TabAE(tab_in, tab_out)
        self.TextBertBase = TextBertBase(text_out)
        self.merge = nn.Linear(tab_out + text_out, num_classes)

    def gradient_checkpointing_enable(self, **kwargs):
        self.TextBertBase.bert.gradient_checkpointing_enable(**kwargs)

    def forward(self, input_ids, attention_mask, token_type_ids, tabular_features, labels):
        tab_features, tab_logits = self.TabAE(tabular_features)
        text_features = self.TextBertBase(input_ids, attention_mask, token_type_ids)
        logits = self.merge(torch.cat([tab_features, text_features], dim=-1))
        loss = nn.functional.cross_entropy(logits, labels)
        loss = loss + nn.functional.binary_cross_entropy_with_logits(tab_logits.squeeze(-1), labels.float())
        return {"loss": loss, "logits": logits}


def build(tab_in: int = 100, tab_out: int = 128, text_out: int = 128, num_classes: int = 2) -> nn.Module:
    return MultimodalBert(tab_in, tab_out, text_out, num_classes)


def batch(batch_size: int, seq_len: int, tab_in: int = 100) -> dict[str, torch.Tensor]:
    """One padded batch as a DataLoader gives it: int64 ids / mask / types / labels, float32 features."""
    attention_mask = torch.ones(batch_size, seq_len, dtype=torch.int64)
    attention_mask[-1, -1] = 0  # real batches are padded to the longest sample
    return {
        "input_ids": torch.randint(0, 30522, (batch_size, seq_len)),
        "attention_mask": attention_mask,
        "token_type_ids": torch.zeros(batch_size, seq_len, dtype=torch.int64),
        "tabular_features": torch.randn(batch_size, tab_in),
        "labels": torch.randint(0, 2, (batch_size,)),
    }
