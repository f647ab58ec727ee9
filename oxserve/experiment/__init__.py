"""Controlled A/B experiments between engine configurations (BRIEF §3, "objectively verifiable")."""
