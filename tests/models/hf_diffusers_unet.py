"""Tiny diffusers conditional U-Net (Stable Diffusion's UNet2DConditionModel), built from its constructor (no
download): ResNet blocks, self- and cross-attention at two resolutions, skip connections from the down to the up
path. Trained as a diffusion model is, to predict the noise added to the latents (MSE), conditioned on a
timestep and text embeddings. seq_len does not shape its inputs: it is not a token model."""

import torch
import torch.nn.functional as F

LATENT, CHANNELS, TEXT_TOKENS, TEXT_WIDTH, STEPS = 16, 4, 8, 32, 1000


def build_model():
    from diffusers import UNet2DConditionModel

    return UNet2DConditionModel(
        sample_size=LATENT,
        in_channels=CHANNELS,
        out_channels=CHANNELS,
        block_out_channels=(32, 64),
        layers_per_block=1,
        cross_attention_dim=TEXT_WIDTH,
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        attention_head_dim=8,
        norm_num_groups=8,
    )


def example_inputs(batch_size, seq_len):
    """(noisy latents, timesteps, text embeddings) and the noise to predict."""
    latents = torch.randn(batch_size, CHANNELS, LATENT, LATENT)
    timesteps = torch.randint(0, STEPS, (batch_size,))
    text = torch.randn(batch_size, TEXT_TOKENS, TEXT_WIDTH)
    return (latents, timesteps, text), torch.randn(batch_size, CHANNELS, LATENT, LATENT)


def loss_fn(output, batch):
    return F.mse_loss(output.sample.float(), batch[1])
