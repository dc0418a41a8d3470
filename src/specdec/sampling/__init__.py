"""How logits become a distribution and how proposals are accepted: pure numpy functions with shape
comments (processors, modified rejection sampling, coupling). Imports nothing else of specdec.
"""
