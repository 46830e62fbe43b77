"""The numpy-only core: one step's batch (`batch`), its statistics (`stats`), the detectors
(`detect`), the Monitor and its halt policy (`monitor`, `config`), the leaf of types every layer
reads (`types`) and the run directory (`run`). Nothing here imports torch, vLLM, Ray or wandb."""
