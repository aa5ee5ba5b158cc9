"""The HTTP child process: the OpenAI-compatible API served over a ZeroMQ client of the front."""
