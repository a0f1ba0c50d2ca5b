"""Tiny Hugging Face ConvNeXt image classifier: 32x32 images, two stages of depthwise-conv blocks that compute in
channels-last layout (permuted activations cross pipeline stages)."""

import torch
import torch.nn.functional as F

IMAGE, CLASSES = 32, 10


def build_model():
    from transformers import ConvNextConfig, ConvNextForImageClassification

    cfg = ConvNextConfig(num_stages=2, hidden_sizes=[16, 32], depths=[2, 2], num_labels=CLASSES, image_size=IMAGE)
    return ConvNextForImageClassification(cfg)


def example_inputs(batch_size, seq_len):
    labels = torch.randint(0, CLASSES, (batch_size,))
    return {"pixel_values": torch.randn(batch_size, 3, IMAGE, IMAGE)}, labels


def loss_fn(output, batch):
    return F.cross_entropy(output.logits.float(), batch[1])
