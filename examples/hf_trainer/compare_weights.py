"""Relative difference of two saved models: ``||a - b|| / ||a||`` over all parameters.

    python examples/hf_trainer/compare_weights.py OUTPUT_DIR_A OUTPUT_DIR_B

Each directory holds the ``model.safetensors`` that ``trainer.save_model`` wrote (full weights,
gathered from the ZeRO-3 partitions). Differences are taken in float64.
"""
import argparse
import pathlib


def load(output_dir):
    """``{name: tensor}`` of ``output_dir/model.safetensors``."""
    from safetensors.torch import load_file
    return load_file(str(pathlib.Path(output_dir) / "model.safetensors"))


def relative_difference(a, b):
    """``||a - b|| / ||a||`` over all tensors of two ``{name: tensor}`` with the same names and shapes."""
    if a.keys() != b.keys():
        raise ValueError(f"different parameters: {sorted(a.keys() ^ b.keys())}")
    num = sum(float(((a[k].double() - b[k].double())**2).sum()) for k in a)
    den = sum(float((a[k].double()**2).sum()) for k in a)
    return (num / den)**0.5


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("a")
    p.add_argument("b")
    args = p.parse_args(argv)
    print(f"{relative_difference(load(args.a), load(args.b)):.3e}")


if __name__ == "__main__":
    main()
