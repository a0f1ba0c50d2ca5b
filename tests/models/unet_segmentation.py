"""A U-Net for image segmentation written as vision code is written (Ronneberger et al. 2015): an encoder of
double-conv blocks that halve the resolution, a decoder that upsamples and concatenates the encoder feature of the
same resolution (the skip connections), and a 1x1 head giving per-pixel class logits."""

import torch
import torch.nn.functional as F
from torch import nn

CLASSES, IMAGE = 3, 32


class DoubleConv(nn.Sequential):
    def __init__(self, cin: int, cout: int) -> None:
        super().__init__(
            nn.Conv2d(cin, cout, 3, padding=1),
            nn.BatchNorm2d(cout),
            nn.ReLU(inplace=True),
            nn.Conv2d(cout, cout, 3, padding=1),
            nn.BatchNorm2d(cout),
            nn.ReLU(inplace=True),
        )


class Up(nn.Module):
    def __init__(self, cin: int, cout: int) -> None:
        super().__init__()
        self.up = nn.ConvTranspose2d(cin, cout, 2, stride=2)
        self.conv = DoubleConv(2 * cout, cout)

    def forward(self, x: torch.Tensor, skip: torch.Tensor) -> torch.Tensor:
        return self.conv(torch.cat([skip, self.up(x)], dim=1))


class UNet(nn.Module):
    def __init__(self, channels: int = 3, classes: int = CLASSES, width: int = 8, depth: int = 3) -> None:
        super().__init__()
        widths = [width * 2**i for i in range(depth + 1)]
        self.stem = DoubleConv(channels, widths[0])
        self.down = nn.ModuleList(DoubleConv(widths[i], widths[i + 1]) for i in range(depth))
        self.up = nn.ModuleList(Up(widths[i + 1], widths[i]) for i in reversed(range(depth)))
        self.head = nn.Conv2d(widths[0], classes, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skips = [self.stem(x)]
        for block in self.down:
            skips.append(block(F.max_pool2d(skips[-1], 2)))
        x = skips.pop()
        for block in self.up:
            x = block(x, skips.pop())
        return self.head(x)


def build_model(width: int = 8, depth: int = 3) -> UNet:
    return UNet(width=width, depth=depth)


def example_inputs(batch_size, seq_len):
    return torch.randn(batch_size, 3, IMAGE, IMAGE), torch.zeros(batch_size, IMAGE, IMAGE, dtype=torch.long)


def loss_fn(output, batch):
    return F.cross_entropy(output.float(), batch[1])
