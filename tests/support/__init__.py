"""Helpers the tests share: synthetic artifacts and run databases (synth), stack
records written the way bpf/stacks.h writes them (stackrecords), fixture programs that
snapshot their own stacks (snaps), captures of real programs (capture), the RSS
fixtures' marks (rss), and reads of this process's own memory (procfs). No tests here."""
