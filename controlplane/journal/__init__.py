"""The event journal: the scheduler's record of every API event, replayed on restart and
checked by ``kvprefetch journal check``, and a trace that ``sim --trace`` and ``train
--trace`` read.

* :mod:`.file`: the file format (header, event, epoch, stop and route records, their
  checksums), the scanner that sets damaged records aside, quarantine and repair;
* :mod:`.trace`: the journal as a trace (its events, the sessions they record);
* :mod:`.writer`: appending records crash-safely;
* :mod:`.live`: what the scheduler writes beyond a trace (sequence numbers, chunk-name
  changes, the checks of its values, lost records);
* :mod:`.compaction`: the journal rewritten without closed sessions' records;
* :mod:`.lifecycle`: the journal over the service's life (replay, flushes, background
  compaction, the stop record).

The package imports only the base layer; the trace loaders and the live service import it.
"""
