"""The OpenAI-compatible HTTP front (see `serving.front.app`)."""

from serving.front.app import create_app
from serving.front.served_model import served_model, served_model_of

__all__ = ["create_app", "served_model", "served_model_of"]
