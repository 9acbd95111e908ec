"""The model shape of the tests that really train: 2 layers, 64 wide, GQA (4 query, 2 KV heads), trains in seconds."""

TINY_MODEL = [
    "model.dim=64",
    "model.n_layers=2",
    "model.n_heads=4",
    "model.n_kv_heads=2",
    "model.ffn_dim=128",
]
