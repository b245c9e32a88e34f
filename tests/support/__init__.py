"""Helpers the tests share: spawning gloo ranks, toy models, checkpoint fixtures."""
