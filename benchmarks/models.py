"""The models of ``bench train``, in plain ``torch.nn``: torchvision's ResNet-18 and ResNet-50,
and BERT-base.

Written out here because the torchvision wheel may not import beside a CPU torch.
"""

import torch
from torch import nn


class _BasicBlock(nn.Module):
    """torchvision's ``BasicBlock``: two 3x3 convolutions and a shortcut."""

    def __init__(self, cin, cout, stride):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.downsample = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False),
                                            nn.BatchNorm2d(cout))

    def forward(self, x):
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        return self.relu(self.bn2(self.conv2(out)) + identity)


class _Bottleneck(nn.Module):
    """torchvision's ``Bottleneck`` (v1.5: the stride on the 3x3 convolution)."""

    expansion = 4

    def __init__(self, cin, width, stride):
        super().__init__()
        cout = width * self.expansion
        self.conv1 = nn.Conv2d(cin, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, cout, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False),
                                            nn.BatchNorm2d(cout))

    def forward(self, x):
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        return self.relu(self.bn3(self.conv3(out)) + identity)


class ResNet18(nn.Module):
    """torchvision's ``resnet18`` (same modules, order and initialisation)."""

    block, depths = _BasicBlock, (2, 2, 2, 2)

    def __init__(self, num_classes=10):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 64, 7, 2, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        widths, cin = (64, 128, 256, 512), 64
        grow = getattr(self.block, "expansion", 1)
        for i, (w, depth) in enumerate(zip(widths, self.depths)):
            stride = 1 if i == 0 else 2
            blocks = [self.block(cin, w, stride)]
            blocks += [self.block(w * grow, w, 1) for _ in range(depth - 1)]
            setattr(self, f"layer{i + 1}", nn.Sequential(*blocks))
            cin = w * grow
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(cin, num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")

    def forward(self, x):
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


class ResNet50(ResNet18):
    """torchvision's ``resnet50``: bottleneck blocks, 3-4-6-3."""

    block, depths = _Bottleneck, (3, 4, 6, 3)


class Bert(nn.Module):
    """A BERT-style encoder with a sequence-classification head (BERT-base by default)."""

    def __init__(self, vocab=30522, hidden=768, layers=12, heads=12, ffn=3072, positions=512,
                 classes=2, dropout=0.1):
        super().__init__()
        self.word = nn.Embedding(vocab, hidden)
        self.position = nn.Embedding(positions, hidden)
        self.token_type = nn.Embedding(2, hidden)
        self.norm = nn.LayerNorm(hidden, eps=1e-12)
        self.drop = nn.Dropout(dropout)
        self.layers = nn.ModuleList(
            nn.TransformerEncoderLayer(hidden, heads, ffn, dropout, activation="gelu",
                                       layer_norm_eps=1e-12, batch_first=True)
            for _ in range(layers))
        self.pooler = nn.Linear(hidden, hidden)
        self.classifier = nn.Linear(hidden, classes)

    def forward(self, ids):
        pos = torch.arange(ids.shape[1])
        x = self.word(ids) + self.position(pos) + self.token_type(torch.zeros_like(ids))
        x = self.drop(self.norm(x))
        for layer in self.layers:
            x = layer(x)
        return self.classifier(torch.tanh(self.pooler(x[:, 0])))
