# Install rules: the component libraries, the umbrella kvshard::kvshard, the public headers, the
# CLI, and a package config so that another project can
#   find_package(kvshard REQUIRED)
#   target_link_libraries(app PRIVATE kvshard::kvshard)   # or kvshard::<component>
include(GNUInstallDirs)
include(CMakePackageConfigHelpers)

install(TARGETS ${KVSHARD_COMPONENT_TARGETS} kvshard EXPORT kvshardTargets
        ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR}
        INCLUDES DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
install(TARGETS kvshard_cli RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})
install(DIRECTORY ${PROJECT_SOURCE_DIR}/include/kvshard DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
install(EXPORT kvshardTargets NAMESPACE kvshard:: DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/kvshard)
configure_package_config_file(${PROJECT_SOURCE_DIR}/cmake/kvshardConfig.cmake.in
  ${CMAKE_BINARY_DIR}/kvshardConfig.cmake
  INSTALL_DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/kvshard)
write_basic_package_version_file(${CMAKE_BINARY_DIR}/kvshardConfigVersion.cmake
  COMPATIBILITY SameMinorVersion)
install(FILES ${CMAKE_BINARY_DIR}/kvshardConfig.cmake ${CMAKE_BINARY_DIR}/kvshardConfigVersion.cmake
        DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/kvshard)
