"""Host-side scheduling, plain Python and numpy: requests, pages, the prefix trie, replicas, preemption, stops."""
