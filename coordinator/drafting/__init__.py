"""Drafters: what proposes the tokens a verify step checks (n-gram, oracle, DFlash on a drafter daemon)."""
