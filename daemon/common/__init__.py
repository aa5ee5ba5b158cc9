"""Torch-free, socket-free parts any of the daemon's processes may import: config, settings, the model
directory and tokenizer, the prefix block hash, chat templates, stop strings and the finish rule, process titles
and supervision."""
