"""The shared RL core: algorithms, batch, policy protocol, loop and configuration."""
