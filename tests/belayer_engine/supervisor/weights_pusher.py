"""A learner in its own process: pushes two partial updates through the engine's weight
endpoint (``python weights_pusher.py SOCKET SEED``) and prints the versions as JSON."""

from __future__ import annotations

import json
import sys

from belayer_engine.model.config import ModelConfig
from belayer_engine.model.weights import init_weights
from belayer_engine.weights.client import EngineWeights


def main(socket_path: str, seed: int) -> None:
    w = init_weights(ModelConfig(), seed)
    engine = EngineWeights(socket_path, timeout=120)
    v1 = engine.update_weights({"model.embed_tokens.weight": w["model.embed_tokens.weight"]})
    # partial, merged with v1 in the engine's kept copy; an explicit version skips ahead
    v2 = engine.update_weights({"model.norm.weight": w["model.norm.weight"] * 2}, version=v1 + 5)
    print(json.dumps({"v1": v1, "v2": v2, "engine_version": engine.version()}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
