"""Convert an HF folder or a GGUF file (or the embedded SmolLM2) into a paxkv orbax checkpoint.

python scripts/convert_checkpoint.py --source path/to/model --output /tmp/model_orbax
"""

import sys

from absl import app, flags

FLAGS = flags.FLAGS
flags.DEFINE_string("source", None, "HF folder or .gguf file; default: the embedded SmolLM2.")
flags.DEFINE_string("output", None, "Empty output folder for the orbax checkpoint.", required=True)
flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "Parameter dtype to store.")


def main(argv):
    del argv
    from models import CheckpointError, load
    from models.orbax_checkpoint import save_orbax

    try:
        loaded = load(FLAGS.source, dtype=FLAGS.dtype)
        save_orbax(loaded, FLAGS.output)
    except (CheckpointError, FileExistsError, ValueError) as e:
        sys.exit(f"convert_checkpoint: {e}")
    print(f"wrote {FLAGS.output} ({loaded.config.model_type}, {loaded.config.num_layers} layers, {FLAGS.dtype})")


if __name__ == "__main__":
    app.run(main)
