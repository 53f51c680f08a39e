"""The contract: the typed Protocols engines and stores implement, and the errors they raise."""
