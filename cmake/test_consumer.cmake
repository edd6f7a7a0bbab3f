# cmake -DBUILD_DIR=<kvshard build> -DSOURCE_DIR=<examples/consumer> -DWORK_DIR=<scratch>
#       [-DGENERATOR=Ninja] [-DBUILD_TYPE=Release] [-DCXX_FLAGS=...] -P test_consumer.cmake
# Installs the kvshard build into WORK_DIR/prefix, configures and builds the consumer project
# against it with find_package(kvshard), and runs it.
function(run)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE out)
  if(NOT rc EQUAL 0)
    list(JOIN ARGN " " cmd)
    message(FATAL_ERROR "failed (${rc}): ${cmd}\n${out}")
  endif()
  message(STATUS "${out}")
endfunction()

file(REMOVE_RECURSE ${WORK_DIR})
set(prefix ${WORK_DIR}/prefix)
run(${CMAKE_COMMAND} --install ${BUILD_DIR} --prefix ${prefix})
set(gen_args "")
if(GENERATOR)
  set(gen_args -G ${GENERATOR})
endif()
run(${CMAKE_COMMAND} -S ${SOURCE_DIR} -B ${WORK_DIR}/build ${gen_args}
    -DCMAKE_BUILD_TYPE=${BUILD_TYPE} -DCMAKE_PREFIX_PATH=${prefix} "-DCMAKE_CXX_FLAGS=${CXX_FLAGS}"
    "-DCMAKE_EXE_LINKER_FLAGS=${CXX_FLAGS}")
run(${CMAKE_COMMAND} --build ${WORK_DIR}/build)
run(${WORK_DIR}/build/kvshard_consumer)
