"""mlx-lm models built from a config with seeded random float32 weights, for the layer-cache kinds
(sliding windows, recurrent state, hybrids) that no checkpoint on disk covers. Imports mlx only
when called: test modules import it after the MLX engine has set up its BLAS."""

from __future__ import annotations


def random_model(kind: str, config: dict):
    import mlx.core as mx
    from mlx_lm.utils import _get_classes

    mx.random.seed(sum(map(ord, kind)))
    model_class, args_class = _get_classes(config)
    model = model_class(args_class.from_dict(config))
    model.set_dtype(mx.float32)
    mx.eval(model.parameters())
    return model
