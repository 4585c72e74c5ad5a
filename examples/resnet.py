"""A ResNet-18 for image classification written by hand, as a user would write it (no torchvision).

The architecture of He et al. 2015 ("Deep Residual Learning for Image Recognition", arXiv:1512.03385,
Table 1, 18-layer) as torchvision's `resnet18` builds it (torchvision/models/resnet.py, BasicBlock): a 7x7
stride-2 stem with BatchNorm, ReLU and 3x3 max-pooling; four stages of two BasicBlocks (64, 128, 256, 512
channels; a 1x1 stride-2 projection where the shape changes); global average pooling and a linear head.
`batch(b, s)` makes `b` RGB images of `s` x `s` pixels and their labels; the loss is cross-entropy.
Estimate it with

    planner estimate --model examples/resnet.py:build --inputs examples/resnet.py:batch \\
        --loss examples/resnet.py:loss --instance ml.g5.xlarge --batch-size 64 --seq-len 224

Options (`-o KEY=VALUE`): `classes`, `width` (channels of the first stage).
"""

from __future__ import annotations

import torch
from torch import nn


class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU(inplace=True)
        self.down = (nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
                     if stride != 1 or cin != cout else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.down is None else self.down(x)
        out = self.relu(self.bn1(self.conv1(x)))
        return self.relu(self.bn2(self.conv2(out)) + identity)


class ResNet18(nn.Module):
    def __init__(self, classes: int = 1000, width: int = 64):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 7, 2, 3, bias=False), nn.BatchNorm2d(width),
                                  nn.ReLU(inplace=True), nn.MaxPool2d(3, 2, 1))
        blocks, cin = [], width
        for i, cout in enumerate((width, 2 * width, 4 * width, 8 * width)):
            stride = 1 if i == 0 else 2
            blocks += [BasicBlock(cin, cout, stride), BasicBlock(cout, cout, 1)]
            cin = cout
        self.blocks = nn.Sequential(*blocks)
        self.head = nn.Linear(cin, classes)

    def forward(self, images: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        """Logits; `labels` (the batch's second tensor, model(*batch)) are for the loss."""
        return self.head(self.blocks(self.stem(images)).mean(dim=(2, 3)))


def build(classes: int = 1000, width: int = 64) -> nn.Module:
    return ResNet18(classes, width)


def batch(b: int, s: int, classes: int = 1000) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(b, 3, s, s), torch.randint(0, classes, (b,))


def loss(output: torch.Tensor, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return nn.functional.cross_entropy(output, batch[1])
