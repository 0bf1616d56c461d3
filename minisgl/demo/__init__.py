"""The demo model: its shipped checkpoint, the task generator it was trained on, the trainer,
and the writer of tiny random checkpoints used by the tests."""
