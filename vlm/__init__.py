"""VLM side: model/processor loading, tiny models, prompts, rollout and the trainer-facing policy."""
