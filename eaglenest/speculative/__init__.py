"""The reference EAGLE-3 speculative decoder: drafting, trees, sampling, evaluation. Serve and eval use it."""
