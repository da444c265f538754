"""The sans-I/O step: the stages that turn a table and its hooks into a buffer to reduce, and a reduced buffer into agreed moves. Nothing here does I/O or imports what does."""
