"""The worker process: one per device, moving messages between its command socket and the engine at step
boundaries and writing tokens into its ring."""
