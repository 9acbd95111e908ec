"""forge's Hydra launcher plugin: `hydra/launcher=torchrun` runs each sweep point under torchrun (Hydra finds
launchers only in the hydra_plugins namespace package)."""
