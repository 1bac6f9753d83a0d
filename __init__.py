"""perceptrl: one RL trainer for vision-language models and vision-language-action policies."""

__version__ = "0.1.0"
