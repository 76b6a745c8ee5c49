"""The overlay's facts and decisions, free of SGLang: settings (config), what a rank sees (facts), the gate,
the PCIe/NUMA topology, and the time-bounded exchange between ranks. torch is imported only inside functions."""
