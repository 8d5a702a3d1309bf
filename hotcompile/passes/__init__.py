"""Graph passes over the AOTAutograd joint graph: find linear sites, rewrite their backward, compress what the forward saves."""
