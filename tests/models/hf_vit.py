"""Tiny Hugging Face ViT image classifier: 32x32 images in 8x8 patches (16 patches + the class token)."""

import torch
import torch.nn.functional as F

HIDDEN, HEADS, LAYERS, IMAGE, PATCH, CLASSES = 64, 4, 4, 32, 8, 10


def build_model():
    from transformers import ViTConfig, ViTForImageClassification

    cfg = ViTConfig(
        hidden_size=HIDDEN,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        intermediate_size=2 * HIDDEN,
        image_size=IMAGE,
        patch_size=PATCH,
        num_labels=CLASSES,
    )
    return ViTForImageClassification(cfg)


def example_inputs(batch_size, seq_len):
    return {"pixel_values": torch.randn(batch_size, 3, IMAGE, IMAGE)}, torch.zeros(batch_size, dtype=torch.long)


def loss_fn(output, batch):
    return F.cross_entropy(output.logits.float(), batch[1])
