"""Tiny Hugging Face Swin Transformer classifier: shifted-window attention with a learned relative-position bias
(one row per head, added to every window's scores) in two stages of 2 and 4 heads."""

import torch
import torch.nn.functional as F

IMAGE, CLASSES = 32, 10


def build_model():
    from transformers import SwinConfig, SwinForImageClassification

    cfg = SwinConfig(
        image_size=IMAGE, patch_size=4, embed_dim=16, depths=[2, 2], num_heads=[2, 4], window_size=4, num_labels=CLASSES
    )
    return SwinForImageClassification(cfg)


def example_inputs(batch_size, seq_len):
    labels = torch.randint(0, CLASSES, (batch_size,))
    return {"pixel_values": torch.randn(batch_size, 3, IMAGE, IMAGE)}, labels


def loss_fn(output, batch):
    return F.cross_entropy(output.logits.float(), batch[1])
