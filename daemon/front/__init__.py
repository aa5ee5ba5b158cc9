"""The front process: client socket, request lifecycle (the socket-free core), scheduling across workers,
validation, metrics, systemd notify, and the worker pool."""
