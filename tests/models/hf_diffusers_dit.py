"""Tiny diffusers DiT (Peebles & Xie 2023, DiTTransformer2DModel), built from its constructor (no download):
16x16 latents in 2x2 patches (64 tokens), adaLN-Zero blocks conditioned on a timestep and a class label. Trained
to predict the noise added to the latents (MSE). seq_len does not shape its inputs: it is not a token model."""

import torch
import torch.nn.functional as F

LATENT, CHANNELS, PATCH, HEADS, HEAD_DIM, LAYERS, CLASSES, STEPS = 16, 4, 2, 4, 16, 4, 10, 1000
TOKENS = (LATENT // PATCH) ** 2


def build_model():
    from diffusers import DiTTransformer2DModel

    return DiTTransformer2DModel(
        num_attention_heads=HEADS,
        attention_head_dim=HEAD_DIM,
        in_channels=CHANNELS,
        out_channels=CHANNELS,
        num_layers=LAYERS,
        sample_size=LATENT,
        patch_size=PATCH,
        num_embeds_ada_norm=CLASSES,
    )


def example_inputs(batch_size, seq_len):
    """(noisy latents, timesteps, class labels) and the noise to predict."""
    latents = torch.randn(batch_size, CHANNELS, LATENT, LATENT)
    timesteps = torch.randint(0, STEPS, (batch_size,))
    labels = torch.randint(0, CLASSES, (batch_size,))
    return (latents, timesteps, labels), torch.randn(batch_size, CHANNELS, LATENT, LATENT)


def loss_fn(output, batch):
    return F.mse_loss(output.sample.float(), batch[1])
