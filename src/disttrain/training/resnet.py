"""`resnet18`: ResNet-18 (He et al., 2015) with BatchNorm, written for small images.

Four stages of two basic blocks (3x3 convolutions, BatchNorm, ReLU, an identity or 1x1
projection shortcut) at widths 64, 128, 256, 512, global average pooling, one linear
layer: 11,173,962 parameters for ten classes. For inputs of 64 pixels or less the stem is
one 3x3 convolution of stride 1 without max-pooling (the usual CIFAR stem: the ImageNet
stem's 4x downsampling would leave a 32x32 image 1x1 before the last stage); larger
inputs get the ImageNet stem, a 7x7 convolution of stride 2 and a max-pool.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

SMALL_IMAGE = 64  # the largest side that gets the small-image stem


class BasicBlock(nn.Module):
    def __init__(self, in_channels: int, out_channels: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(out_channels)
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, stride=1, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(out_channels)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or in_channels != out_channels:
            self.shortcut = nn.Sequential(nn.Conv2d(in_channels, out_channels, 1, stride=stride, bias=False),
                                          nn.BatchNorm2d(out_channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class ResNet18(nn.Module):
    """Images (B, C, H, W) -> class logits (B, num_classes).

    Args:
        width: channels of the first stage (64; the later ones double it). Tests use 8.
        blocks: basic blocks per stage (2, as ResNet-18).
    """

    def __init__(self, input_shape: tuple[int, int, int], num_classes: int = 10, width: int = 64,
                 blocks: int = 2):
        super().__init__()
        channels, height, width_px = input_shape
        if max(height, width_px) <= SMALL_IMAGE:
            self.stem = nn.Sequential(nn.Conv2d(channels, width, 3, stride=1, padding=1, bias=False),
                                      nn.BatchNorm2d(width), nn.ReLU())
        else:
            self.stem = nn.Sequential(nn.Conv2d(channels, width, 7, stride=2, padding=3, bias=False),
                                      nn.BatchNorm2d(width), nn.ReLU(), nn.MaxPool2d(3, stride=2, padding=1))
        stages, in_channels = [], width
        for stage in range(4):
            out_channels = width * 2 ** stage
            for block in range(blocks):
                stride = 2 if stage > 0 and block == 0 else 1
                stages.append(BasicBlock(in_channels, out_channels, stride))
                in_channels = out_channels
        self.stages = nn.Sequential(*stages)
        self.fc = nn.Linear(in_channels, num_classes)
        for module in self.modules():
            if isinstance(module, nn.Conv2d):
                nn.init.kaiming_normal_(module.weight, mode="fan_out", nonlinearity="relu")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stages(self.stem(x))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))
