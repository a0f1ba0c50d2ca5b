"""A training script's model definition, importing the model class from its sibling file as nanoGPT does."""

from model import GPT


def build_model(**kwargs):
    return GPT(**kwargs)
