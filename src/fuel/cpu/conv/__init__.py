"""Conv2D, ConvTranspose2D and CausalConv1d."""
