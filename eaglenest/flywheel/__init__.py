"""flywheel: served traffic -> capture -> retrain -> gate -> swap without downtime -> watch and roll back."""
