"""aserve: an asyncio-native inference server for deep-learning models."""

__version__ = "0.1.0"
