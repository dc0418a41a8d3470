"""What export writes and the runtime trusts: the manifest (one frozen dataclass per bundle), field checks,
the safe opening of a bundle, and the one table of request/pass limits. Imports nothing else of specdec.
"""
