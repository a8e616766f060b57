#!/bin/bash
# usage: sass_check.sh file.cubin -> HGMMA count, LDL/STL count, MUFU between DEPBAR 1 and the next DEPBAR 0
export PATH=$PATH:/tmp/cudatools/nvidia/cu13/bin:/tmp/cudatools2/nvidia/cu13/bin
cuobjdump -sass $1 > /tmp/$(basename ${1%.cubin}).sass
s=/tmp/$(basename ${1%.cubin}).sass
echo "HGMMA=$(grep -c HGMMA $s) LDLSTL=$(grep -cE 'LDL|STL' $s) overlapMUFU=$(awk '/DEPBAR.LE gsb0, 0x1/{f=1;n=0} f&&/MUFU.EX2/{n++} f&&/DEPBAR.LE gsb0, 0x0/{print n; f=0}' $s | tr '\n' ' ')"
